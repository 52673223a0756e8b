import logging, time
logging.basicConfig(level=logging.DEBUG)
for n in ("mlx_actor_runtime.llamacpp",): logging.getLogger(n).setLevel(logging.DEBUG)
import numpy as np, mlx.core as mx
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.messages import ModelSpec
t=time.time()
b=LlamaCppBackend.load(ModelSpec(name='s', backend='llamacpp', path='smollm2-135m-instruct', options={"n_threads":2}))
print('load', time.time()-t)
s=b.new_state(); b.prefill(s, b.encode("Hello there"))
b.feed(s, mx.array(5))
