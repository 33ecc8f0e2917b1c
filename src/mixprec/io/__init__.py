"""Reading and writing models safely: load/save, external data, input checks and repairs,
protobuf helpers, feeds.
"""
