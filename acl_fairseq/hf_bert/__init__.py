"""Hugging Face BERT -> fairseq RoBERTa: the state-dict mapping (``state``), the vocabulary
(``vocab``) and the conversion of a model folder into a fairseq checkpoint folder (``convert``)."""
