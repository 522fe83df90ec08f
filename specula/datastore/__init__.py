"""REST datastores: a token corpus with its suffix array (format), built from text files
(build), searched per decode step (query)."""

from specula.datastore.format import Datastore, DatastoreError, DatastoreHeader, load_datastore
from specula.datastore.tokenizers import load_tokenizer, tokenizer_fingerprint

__all__ = ["Datastore", "DatastoreError", "DatastoreHeader", "load_datastore", "load_tokenizer", "tokenizer_fingerprint"]
