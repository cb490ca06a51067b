"""convbn.passes: torch.fx graph passes.

``convert`` (training: fuse Conv -> BN -> act chains) and ``fold`` (inference: fold BN
into neighbouring layers) live in modules of the same names; use ``convbn.convert`` /
``convbn.fold`` (re-exporting them here would shadow the modules).
"""
