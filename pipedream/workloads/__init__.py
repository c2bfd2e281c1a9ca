"""Built-in workloads: ``mlp`` (synthetic regression), ``gpt`` (small decoder-only LM on a
structured synthetic token stream), ``digits`` (scikit-learn's 8x8 handwritten digits), ``resnet``
(residual CNN on synthetic images, traced with torch.export) and
``sleep`` (layers that only sleep, for schedule benchmarks)."""

__all__: list[str] = []
