"""An Apex-era ImageNet-style training script (the shape of Apex's own
examples/imagenet/main_amp.py and its descendants), unmodified: apex.parallel
DDP and SyncBatchNorm, apex.fp16_utils helpers, apex.optimizers, amp_C through
multi_tensor_applier, Apex's private amp state, and an amp checkpoint.
Tiny synthetic images stand in for the dataset.

usage: imagenet_amp.py CHECKPOINT [--opt-level O2] [--sync_bn] [--epochs 2]
(under torchrun with WORLD_SIZE > 1 it trains data-parallel over gloo)
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from apex.parallel import DistributedDataParallel as DDP
    from apex.fp16_utils import *
    from apex import amp, optimizers
    from apex.multi_tensor_apply import multi_tensor_applier
except ImportError:
    raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example.")
import amp_C
import apex

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("checkpoint")
parser.add_argument("--epochs", default=2, type=int)
parser.add_argument("--lr", default=0.05, type=float)
parser.add_argument("--opt-level", type=str, default="O2")
parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
parser.add_argument("--loss-scale", type=str, default=None)
parser.add_argument("--sync_bn", action="store_true")
parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
args = parser.parse_args()

args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
args.world_size = 1
if args.distributed:
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
    args.world_size = dist.get_world_size()


class TinyResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


torch.manual_seed(0)
model = TinyResNet()
if args.sync_bn:
    model = apex.parallel.convert_syncbn_model(model)
optimizer = optimizers.FusedSGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                  keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
if args.distributed:
    model = DDP(model, delay_allreduce=True)
criterion = nn.CrossEntropyLoss()

g = torch.Generator().manual_seed(1 + dist.get_rank() if args.distributed else 1)
data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
overflow_buf = torch.zeros(1, dtype=torch.int)

losses, scales, grad_norms = [], [], []
for epoch in range(args.epochs):
    model.train()
    for i, (input, target) in enumerate(data):
        output = model(input)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        grad_norms.append(to_python_float(norm))
        optimizer.step()
        reduced_loss = reduce_tensor(loss.data) if args.distributed else loss.data
        losses.append(to_python_float(reduced_loss))
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())

# rank 0 saves (as Apex's ImageNet example did); every rank reads it once it is written
if not args.distributed or dist.get_rank() == 0:
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
               args.checkpoint)
if args.distributed:
    dist.barrier()
checkpoint = torch.load(args.checkpoint, weights_only=False)
amp.load_state_dict(checkpoint["amp"])
module = model.module if args.distributed else model
checksum = sum(float(p.detach().double().sum()) for p in module.parameters())
sys.stdout.flush()
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(dict(
    rank=dist.get_rank() if args.distributed else 0, losses=losses, scales=scales, grad_norms=grad_norms,
    checksum=checksum, opt_level=amp._amp_state.opt_properties.opt_level,
    weight_dtype=str(module.conv1.weight.dtype), bn_dtype=str(module.bn1.weight.dtype),
    saved_dtype=str(checkpoint["state_dict"][("module." if args.distributed else "") + "conv1.weight"].dtype),
    ddp=type(model).__module__, amp_module=amp.__spec__.name, output_dtype=str(output.dtype),
)) + "\n").encode())
if args.distributed:
    dist.destroy_process_group()
