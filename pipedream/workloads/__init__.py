"""Built-in workloads: ``mlp`` (synthetic regression), ``gpt`` (small decoder-only LM on a
structured synthetic token stream) and ``digits`` (scikit-learn's 8x8 handwritten digits)."""

__all__: list[str] = []
