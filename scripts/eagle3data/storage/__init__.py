"""Where the states' bytes live: the per-sample store, its atomic writes, compression, reading the
bytes back, and the disk they need.
"""
