def decoder_module(*a, **k): raise NotImplementedError
def decoder_example(*a, **k): raise NotImplementedError
