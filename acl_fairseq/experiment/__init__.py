"""What the research tools share (``acl-fairseq-compare``, ``-fewshot``, ``-plots``, ``-demo``):
fairseq-train recipes, results folders, fairseq's log, per-example predictions, paired
statistics and the few-shot protocol."""
