"""The vLLM engines that capture states: starting one, the node's pool of engines shared across
extract jobs, the server that outlives a job, and the GPUs a job claims.
"""
