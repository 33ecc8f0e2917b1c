"""Weight-only INT4/INT8 on decoders and MiniLM, with language-model evaluation."""
