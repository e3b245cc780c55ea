"""Hugging Face BERT -> fairseq RoBERTa: the state-dict mapping (``state``) and the conversion of
a model folder into a fairseq checkpoint folder (``convert``)."""
