"""``acl-fairseq-compare``: fine-tuning methods compared over seeds (plan, run, report)."""
