"""The target checkpoint: facts read from its config.json, and the models the pipeline builds itself
(the demo, a GGUF turned into a checkpoint, full-size shapes) in directories it marks as its own.
"""
