"""Published model shapes the GPU benches build with random weights: the table lives in the package
(poolbench.extractor.model_shapes) so `--model shape:NAME` loads one anywhere; the benches import it from here."""

from poolbench.extractor.model_shapes import SHAPES

__all__ = ["SHAPES"]
