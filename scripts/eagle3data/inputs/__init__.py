"""The user's chats turned into training samples: reading every accepted format, rendering the
chat template with the assistant-only loss mask, and the shard plan.
"""
