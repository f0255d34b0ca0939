"""Synthetic training benchmark with c10d_ext.horovod, following Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py: the same flags, the same hvd calls in the same
order (the optimizer is wrapped before the broadcasts), the same log lines.

--model defaults to "smallcnn", a small CNN defined here (no torchvision, nothing to download);
any other name is looked up in torchvision.models when torchvision is installed (e.g. resnet50,
Horovod's default). Run it with

    python -m c10d_ext.horovod.run -np 2 python examples/horovod/pytorch_synthetic_benchmark.py --no-cuda
    torchrun --nproc-per-node 2 examples/horovod/pytorch_synthetic_benchmark.py --no-cuda
"""

import argparse
import timeit

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import c10d_ext.horovod as hvd
from smallcnn import SmallCNN


MODELS = {'smallcnn': SmallCNN}


def make_model(name):
    if name in MODELS:
        return MODELS[name]()
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit('model %r needs torchvision (not installed); built in: %s'
                         % (name, ', '.join(sorted(MODELS))))
    return getattr(models, name)()


# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='compress gradients to float16 for the allreduce')

parser.add_argument('--model', type=str, default='smallcnn',
                    help='model to benchmark: smallcnn, or a torchvision.models name')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='warm-up batches, not counted in the results')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='run on the CPU even where CUDA is available')

parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='reduce gradients with Adasum instead of averaging')

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up the model.
model = make_model(args.model)

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()
    # If using GPU Adasum allreduce, scale learning rate by local_size.
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Fixed synthetic data
data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
