"""What a run will do before it does it: the shard plan shared by the rules and the jobs, and the disk
the states will need.
"""
