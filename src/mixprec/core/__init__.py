"""Facts and small shared types: errors, op facts, the op registry, policy, configs, graph
iteration, metrics.
"""
