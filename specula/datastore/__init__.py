"""REST datastores: a token corpus with its suffix array (format), built from text files
(build), searched per decode step (query)."""

from specula.datastore.format import Datastore, DatastoreError, DatastoreHeader, load_datastore
from specula.datastore.tokenizers import tokenizer_fingerprint

__all__ = ["Datastore", "DatastoreError", "DatastoreHeader", "load_datastore", "tokenizer_fingerprint"]


def __getattr__(name: str):
    if name == "load_tokenizer":
        raise AttributeError("specula.datastore.load_tokenizer moved: use specula.models.loading.load_tokenizer")
    raise AttributeError(f"module 'specula.datastore' has no attribute {name!r}")
