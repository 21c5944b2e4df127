"""Utilities every room uses: logging visible in every process, overlapped I/O, and the test-only hooks.
"""
