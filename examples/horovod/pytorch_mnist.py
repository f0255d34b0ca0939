"""MNIST training with c10d_ext.horovod, following Horovod's examples/pytorch/pytorch_mnist.py:
the same flags and defaults, the same hvd calls in the same order, the same log lines.

The data set is generated, not downloaded: a fixed-seed synthetic MNIST (60000 training and
10000 test images of 1x28x28, ten classes, normalized like MNIST) that a small CNN learns in an
epoch. Run it with

    python -m c10d_ext.horovod.run -np 2 python examples/horovod/pytorch_mnist.py --no-cuda --epochs 1
    torchrun --nproc-per-node 2 examples/horovod/pytorch_mnist.py --no-cuda --epochs 1
    python examples/horovod/pytorch_mnist.py --num-proc 2 --no-cuda --epochs 1
"""

import argparse

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import c10d_ext.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                    help='input batch size for training (default: 64)')
parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                    help='input batch size for testing (default: 1000)')
parser.add_argument('--epochs', type=int, default=10, metavar='N',
                    help='number of epochs to train (default: 10)')
parser.add_argument('--lr', type=float, default=0.01, metavar='LR',
                    help='learning rate (default: 0.01)')
parser.add_argument('--momentum', type=float, default=0.5, metavar='M',
                    help='SGD momentum (default: 0.5)')
parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='train on the CPU even where CUDA is available')
parser.add_argument('--seed', type=int, default=42, metavar='S',
                    help='random seed (default: 42)')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                    help='batches between two training log lines (default: 10)')
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='compress gradients to float16 for the allreduce')
parser.add_argument('--use-mixed-precision', action='store_true', default=False,
                    help='train with automatic mixed precision (CUDA only)')
parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='reduce gradients with Adasum instead of averaging')
parser.add_argument('--gradient-predivide-factor', type=float, default=1.0,
                    help='gradient predivide factor of the DistributedOptimizer (default: 1.0)')
parser.add_argument('--data-dir',
                    help='accepted for compatibility; the synthetic data set is generated in memory')
parser.add_argument('--train-samples', type=int, default=60000,
                    help='size of the generated training set (not a Horovod flag; default: 60000, MNIST\'s)')

# Used when the script is not started by a launcher
parser.add_argument('--num-proc', type=int)
parser.add_argument('--hosts', help='hosts to run on: hostname:slots[,host2:slots[,...]]')
parser.add_argument('--communication', help='accepted for compatibility: gloo, mpi')


# --------------------------------------------------------------------------- synthetic data
DATA_SEED = 20231127
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def _prototypes(gen):
    """Ten 28x28 "digits": smooth random strokes (a 7x7 random field, upsampled, thresholded)."""
    coarse = torch.rand(10, 1, 7, 7, generator=gen)
    fine = F.interpolate(coarse, size=(24, 24), mode='bilinear', align_corners=False)[:, 0]
    strokes = (fine > fine.flatten(1).quantile(0.7, dim=1).view(10, 1, 1)).float()
    return F.pad(strokes, (2, 2, 2, 2))  # 10 x 28 x 28 in [0, 1]


class SyntheticMNIST(torch.utils.data.TensorDataset):
    """A fixed-seed MNIST stand-in: uint8 images (a class prototype shifted by up to 2 pixels,
    plus noise) and int64 labels; items come out as normalized float 1x28x28 like MNIST's."""

    def __init__(self, train=True, samples=60000):
        gen = torch.Generator().manual_seed(DATA_SEED)
        protos = _prototypes(gen)
        shifted = torch.stack([torch.roll(protos, (dy, dx), dims=(1, 2))
                               for dy in range(-2, 3) for dx in range(-2, 3)])  # 25 x 10 x 28 x 28
        gen.manual_seed(DATA_SEED + (1 if train else 2))
        n = samples if train else 10000
        labels = torch.randint(0, 10, (n,), generator=gen)
        shifts = torch.randint(0, 25, (n,), generator=gen)
        images = torch.empty(n, 28, 28, dtype=torch.uint8)
        for lo in range(0, n, 10000):
            hi = min(n, lo + 10000)
            x = shifted[shifts[lo:hi], labels[lo:hi]] * 0.8 + 0.35 * torch.randn(hi - lo, 28, 28, generator=gen)
            images[lo:hi] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
        super().__init__(images, labels)

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return ((image.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(0), label


# --------------------------------------------------------------------------- model
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def main(args):
    def train_mixed_precision(epoch, scaler):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            with torch.autocast('cuda'):
                output = model(data)
                loss = F.nll_loss(output, target)
            scaler.scale(loss).backward()
            # Horovod: wait for the gradient allreduces before unscaling them.
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            if batch_idx % args.log_interval == 0:
                # Horovod: train_sampler holds this worker's share of the examples.
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\tLoss Scale: {}'.format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item(), scaler.get_scale()))

    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                # Horovod: train_sampler holds this worker's share of the examples.
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item()))

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction='sum').item()
                # index of the largest log-probability
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()

        # Horovod: test_sampler holds this worker's share of the examples.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average the metrics over the workers.
        test_loss = metric_average(test_loss, 'avg_loss')
        test_accuracy = metric_average(test_accuracy, 'avg_accuracy')

        # Horovod: print output only on the first rank.
        if hvd.rank() == 0:
            print('\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n'.format(
                test_loss, 100. * test_accuracy))

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    else:
        if args.use_mixed_precision:
            raise ValueError("Mixed precision is only supported with cuda enabled.")

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {'num_workers': 1, 'pin_memory': True} if args.cuda else {}
    # 'forkserver' for data loader workers where available (fork is unsafe with some RDMA stacks)
    if (kwargs.get('num_workers', 0) > 0 and hasattr(mp, '_supports_context') and
            mp._supports_context and 'forkserver' in mp.get_all_start_methods()):
        kwargs['multiprocessing_context'] = 'forkserver'

    train_dataset = SyntheticMNIST(train=True, samples=args.train_samples)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs)

    test_dataset = SyntheticMNIST(train=False)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler, **kwargs)

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                          momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    if args.use_mixed_precision:
        # Initialize scaler in global scale
        scaler = torch.amp.GradScaler('cuda')

    for epoch in range(1, args.epochs + 1):
        if args.use_mixed_precision:
            train_mixed_precision(epoch, scaler)
        else:
            train_epoch(epoch)
        # Keep test in full precision since computation is relatively light.
        test()


if __name__ == '__main__':
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    if args.num_proc:
        # run training through horovod.run (c10d_ext.horovod.run.run)
        from c10d_ext.horovod.run import run as horovod_run
        print('Running training through horovod.run')
        horovod_run(main,
                    args=(args,),
                    np=args.num_proc,
                    hosts=args.hosts,
                    use_gloo=args.communication == 'gloo',
                    use_mpi=args.communication == 'mpi')
    else:
        # this is running via a launcher (c10d_ext.horovod.run or torchrun)
        main(args)
