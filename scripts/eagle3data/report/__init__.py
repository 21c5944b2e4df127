"""Pages of `snakemake --report`: counts and skip reasons, lengths, norms, throughput, regeneration.
"""
