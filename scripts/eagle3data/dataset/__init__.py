"""The packed dataset: its Arrow format and reader, packing each validated shard, the index over
the shards, the card, the stand-alone check, and duplicates across shards.
"""
