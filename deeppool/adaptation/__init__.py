"""Adapting training to its resources: the methods of the literature deeppool grows out of.

* :mod:`~deeppool.adaptation.gns`: the gradient noise scale from norms at two batch sizes, per layer group;
* :mod:`~deeppool.adaptation.adascale`: AdaScale's gain ratio, LR and scale-invariant progress;
* :mod:`~deeppool.adaptation.adasum`: Adasum, pairwise and over a process group;
* :mod:`~deeppool.adaptation.kfac`: K-FAC's Kronecker-factored preconditioner, over a plan's layer groups
  (its options in :mod:`~deeppool.adaptation.kfac_options`);
* :mod:`~deeppool.adaptation.goodput`: Pollux's statistical efficiency and goodput;
* :mod:`~deeppool.adaptation.stragglers`: straggler detection as in Resource Elasticity.

See ``docs/adaptation.md``.
"""
