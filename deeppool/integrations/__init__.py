"""deeppool inside the training frameworks people already use, each a layer over :func:`deeppool.parallelize`.

Each integration is imported on its own (``from deeppool.integrations.lightning import DeeppoolStrategy``)
and needs its framework installed (``pip install 'deeppool[lightning]'``); importing ``deeppool`` imports
none of them.
"""
