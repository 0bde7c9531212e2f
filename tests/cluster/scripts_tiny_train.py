"""A small slipstream.accelerate script for `slipstream bench` tests."""

import torch
import torch.nn.functional as F

import slipstream

rt = slipstream.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
run = slipstream.accelerate(model, opt, log_every_steps=5, total_steps=30, progress=False)
g = torch.Generator().manual_seed(rt.rank)
for _ in range(30):
    x = torch.randn(32, 64, generator=g)
    loss = F.cross_entropy(run.model(x), (x[:, :4]).argmax(1))
    run.backward(loss)
    run.step()
run.finish()
slipstream.shutdown(exit_code=0)  # skip interpreter teardown (gloo may abort there)
