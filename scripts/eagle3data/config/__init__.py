"""The run's configuration: validated with errors that fit a screen, completed from the checkpoint,
and told back before GPU hours are spent (`snakemake preflight`).
"""
