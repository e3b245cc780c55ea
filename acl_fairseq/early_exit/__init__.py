"""Early exit: the policies, the loop, the speed/accuracy curve and the saved policy.

``policies`` (pure torch: the kinds and their rules), ``loop`` (the batched loop of
``MultiExitRobertaModel.early_exit``), ``thresholds`` (the curve from one pass over every exit
and the choice of a threshold), ``saved_policy`` (``early_exit_policy.json``), ``measure``
(accuracy and wall-clock speed over thresholds) and ``table`` (the sweep table's file).
"""
