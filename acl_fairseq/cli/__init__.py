"""The command-line tools of acl-fairseq (console commands ``acl-fairseq-*``)."""
