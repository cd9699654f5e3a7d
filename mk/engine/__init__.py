"""The engine a model decodes on, split by job: prefill (:mod:`.prefill`), the decode steps
and the slots they share (:mod:`.steps`), the ranks of a tensor-parallel model
(:mod:`.ranks`), a static batch's request stream (:mod:`.stream`, what ``generate`` runs),
and continuous batching (:mod:`.scheduler`, what ``mk serve`` runs). Both clients drive the
same steps over the same slots."""

import mk.models  # noqa: F401  (first: mk.models' decoder imports this package's modules)
