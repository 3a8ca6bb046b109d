"""What the prep stage (``dataprep``) and the data loaders (``mmtrain.data``) share: the ``.bin/.idx`` token
format (``mmtrain.core.indexed``) and the tokenizer interface (``mmtrain.core.tokenizer``); and what the prep
stage and the server share: chat templates (``mmtrain.core.chat_template``, ``mmtrain.core.chat_tokens``).

Both sides import this package and never each other. It imports nothing of mmtrain but ``mmtrain.utils``
(tests/unit/test_import_layering.py checks), and no torch.
Public (loaded lazily): ``IndexedDataset``, ``IndexedDatasetWriter``, ``Tokenizer``, ``load_tokenizer``,
``TokenizerError``. Everything else in this package is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "IndexedDataset": "mmtrain.core.indexed", "IndexedDatasetWriter": "mmtrain.core.indexed",
    "Tokenizer": "mmtrain.core.tokenizer", "load_tokenizer": "mmtrain.core.tokenizer",
    "TokenizerError": "mmtrain.core.tokenizer",
}
__all__ = ["IndexedDataset", "IndexedDatasetWriter", "Tokenizer", "TokenizerError", "load_tokenizer"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
