"""The `validate` stage: every states file judged against its tokens and the capture contract;
failing samples quarantined with a reason; what counts as reproducible.
"""
