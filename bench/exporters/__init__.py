"""The models the bench derives: MiniLM, the MNIST CNN, decoders with KV caches."""
