"""Model delivery for pods: ``stage-runtime fetch-model URL DIR --sha256 HEX [--cache DIR]`` (an init
container's command) and the node-local cache the stage marks as in use while it serves.

    download.download        resumable HTTP(S) download, SHA-256 verified
    archive.extract          tar / tar.gz / zip, unpacked safely; the pipeline folder inside
    cache.ModelCache         by-digest store, LRU eviction under a byte budget, in-use flocks (`hold`)
    model.fetch_model        the whole delivery: download → verify → unpack → atomic rename (or cache + link)
    command                  the CLI: edge validation, exit codes, the termination message

Standard library only (plus pydantic at the edge): none of it imports torch.
"""
