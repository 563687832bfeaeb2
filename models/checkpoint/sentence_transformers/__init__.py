"""sentence-transformers' files in a checkpoint (config_sentence_transformers.json, modules.json, each module's
folder): keys.py classifies every key as honoured, harmless or refused; settings.py reads a SentenceTransformer's
modules into ModelSettings, multivector.py a MultiVectorEncoder's."""
