"""The contracts that cross stage boundaries: layer semantics, the states file and its facts, the
pandera tables, and failures named as sample / check / expected / found.
"""
