"""Where the states' bytes live: the per-sample store, its atomic writes, compression (and the opt-in
lossy fp8 codes), reading the bytes back, and the disk they need.
"""
