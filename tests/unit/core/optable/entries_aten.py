"""Op table entries for the names torch exposes at top level with aten's signatures: the losses
(reduction as an integer enum, options positional in aten's order) and prelu."""

from __future__ import annotations

from tests.unit.core.optable.table import A, S, op

_M = (3, 4)

ENTRIES = [
    op("prelu", (S(A((2, 3, 4)), A((3,), "pos")), S(A(_M), A((1,), "pos")), S(A((5,)), A((1,)))),
       forms=("function",), error=(S(A((2, 3, 4)), A((2,))), RuntimeError)),
    op("binary_cross_entropy_with_logits",
       # (no sample with weight or pos_weight: torch's top-level binding has no gradient for
       # them and refuses them requiring grad; F.binary_cross_entropy_with_logits covers them)
       (S(A(_M), A(_M, "unit")),
        S(A(_M), A(_M, "unit"), None, None, 2), S(A(_M), A(_M, "unit"), None, None, 7)),
       forms=("function",), error=(S(A(_M), A((2, 4))), RuntimeError)),
    op("cosine_embedding_loss",
       (S(A(_M), A(_M), A((3,), "sign")), S(A(_M), A(_M), A((3,), "sign"), 0.2, 0)),
       forms=("function",), error=(S(A(_M), A((2, 4)), A((3,), "sign")), RuntimeError)),
    op("hinge_embedding_loss",
       (S(A(_M), A(_M, "sign")), S(A(_M), A(_M, "sign"), 0.5, 2)),
       forms=("function",), error=(S(A(_M), A((2, 4), "sign")), RuntimeError)),
    op("margin_ranking_loss",
       (S(A((5,)), A((5,)), A((5,), "sign")), S(A((5,)), A((5,)), A((5,), "sign"), 0.3, 0)),
       forms=("function",), error=(S(A((5,)), A((4,)), A((5,), "sign")), RuntimeError)),
    op("poisson_nll_loss",
       (S(A(_M), A(_M, "pos"), True, False, 1e-8, 1), S(A(_M, "pos"), A(_M, "pos"), False, True,
                                                         1e-8, 0)),
       forms=("function",), error=(S(A(_M), A((2, 4), "pos"), True, False, 1e-8, 1), RuntimeError)),
    op("triplet_margin_loss",
       (S(A(_M), A(_M), A(_M)), S(A(_M), A(_M), A(_M), 0.5, 1.0, 1e-6, True, 2)),
       forms=("function",), error=(S(A(_M), A((2, 4)), A(_M)), RuntimeError)),
    # Python 2's division names, which torch.Tensor still carries
    op("__div__", (S(A(_M, "pos"), A(_M, "pos")), S(A(_M, "pos"), 2.0)), forms=("call",),
       call=lambda lib, x, y: x.__div__(y), error=(S(A(_M), A((2, 4))), RuntimeError)),
    op("__rdiv__", (S(A(_M, "pos"), 2.0),), forms=("call",),
       call=lambda lib, x, y: x.__rdiv__(y)),
]
