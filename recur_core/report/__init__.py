"""The report room: what is written about a checkpoint from its measurements. `export` ships a trained
checkpoint with its measured card (`hops_card` for multi-hop programs, `mixture_card` for text mixed
with word problems); `sources` names the training data by source."""
