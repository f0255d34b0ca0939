// Every run-time knob of the backend. c10d_ext/config.py parses the MYCCL_* environment
// variables (and c10d_ext.Options) and hands the result to C++ as one Config, so the two
// languages never disagree about a default and C++ never reads the environment itself.
#pragma once

#include <cstdint>
#include <string>

namespace myccl {

struct Config {
  // Transport choice: "auto" (shared memory between ranks of one host, TCP across hosts),
  // "tcp" (TCP everywhere, also on one host), "shm" (fail if a peer is on another host).
  std::string transport = "auto";
  // Interfaces for TCP listeners: "" (route to master_addr), "eth0,eth1", or "^docker,lo".
  std::string socketIfname;
  // Where the job's rendezvous host is; the default interface is the one routing to it.
  std::string masterAddr;
  // Overrides the host identity used to decide which ranks share memory.
  std::string hostId;
  // Groups spanning hosts: two levels (shared memory inside hosts, leaders across) or flat TCP.
  bool hierarchical = true;
  // Threads a group may use for reductions and copies (the progress thread included).
  int numThreads = 1;
  // Collective fingerprints checked across ranks before every op (MYCCL_DEBUG=DETAIL).
  bool debugDetail = false;
  // Messages up to this size are sent eagerly; larger ones wait for the receiver (TCP).
  int64_t tcpEagerBytes = 64 * 1024;
  // The same for peers on this host: up to this size (from 16 KiB) a message is copied into a
  // shared-memory mailbox slot and sent at once; larger ones, and those that find every slot
  // full, are copied directly out of the sender's memory (process_vm_readv), whose three
  // hand-offs cost more than two in-cache copies below about 1 MiB. Also the slot size.
  int64_t localEagerBytes = 1024 * 1024;
  // Threads that copy one large direct message (process_vm_readv); the sender waits meanwhile,
  // so a second thread uses the core it leaves idle.
  int copyThreads = 2;
  // Sockets (each with its own thread) a large message to a peer on another host is spread over.
  int socketsPerPeer = 2;
  // Segment size for pipelined TCP algorithms.
  int64_t tcpChunkBytes = 4 * 1024 * 1024;
  // Size of each of the two shared-memory staging buffers per rank (the pipeline chunk).
  int64_t shmBufferBytes = 1 << 20;
  // Results of at least this many bytes are written with streaming stores (cpu/Copy.hpp);
  // -1 = the last-level cache's size, 0 = never.
  int64_t streamStoreBytes = -1;
  // How long a waiting thread spins before sleeping (microseconds); -1 = adapt to cores.
  int64_t spinUs = -1;
  // CUDA: block the host in wait() and raise on timeout instead of stream-ordering.
  bool blockingWait = false;
  // CUDA: hold tensors in the Work instead of recordStream.
  bool avoidRecordStreams = false;
  // CUDA: take a high-priority stream from torch's pool.
  bool highPriorityStream = false;
  // Testing only: pause before connecting the TCP mesh (lets a test knock on a listener).
  int64_t testConnectDelayMs = 0;
  // Flight recorder ring size per group (0 = off) and dump location prefix.
  int64_t flightRecorderEntries = 128;
  std::string flightRecorderDump = "/tmp/myccl_flight_recorder";
};

}  // namespace myccl
