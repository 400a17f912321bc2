"""``rapidspec bench``: decode speed of each mode against lc and the peers, memory, figures.

* :mod:`.inputs`: the prompts (the built-in document at each length, or a
  file's items) and the peer modes; the run matrix is evaluation's
  (:mod:`rapidspec.evaluation.variants`).
* :mod:`.speed`: the harness (warm-up, repeats, medians, the profile of where
  decode time goes); :mod:`.results`: its report; :mod:`.llama_peer`:
  llama.cpp's plain decoding of the same GGUF; :mod:`.memory`: peak memory;
  :mod:`.plot`: figures.
* :mod:`.serve`: ``rapidspec bench serve``, the HTTP load client (imports
  neither torch nor FastAPI).
"""
