"""The `extract` stage: the connector that writes each sample's states from vLLM's workers, the
host buffers it reuses, and the watcher that checks each file as it lands.
"""
