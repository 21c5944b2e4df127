"""The optional `regenerate` stage: the target writes the assistant turns anew, journaled so a
killed job resumes, and the result tokenized as an input shard.
"""
