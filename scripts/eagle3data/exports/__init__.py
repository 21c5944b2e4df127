"""Trainer layouts: what speculators and SpecForge read, the exports into their formats, the readers
that train from the packed rows in place, and the draft vocabulary.
"""
