// Every run-time knob of the backend. c10d_ext/config.py parses the MYCCL_* environment
// variables (and c10d_ext.Options) and hands the result to C++ as one Config, so C++ never reads
// the environment itself. Each field is declared once, in MYCCL_CONFIG_FIELDS: the struct, its
// Python binding (c10d_ext._C.Config) and config.py's defaults all come from that list; what a
// field means is documented with its environment variable in config.py. A field's Python name is
// its variable's name without MYCCL_, in lower case (one name per concept).
#pragma once

#include <cstdint>
#include <string>

// X(type, member, Python name, default)
#define MYCCL_CONFIG_FIELDS(X)                                                                  \
  X(std::string, transport, "transport", "auto")          /* MYCCL_TRANSPORT */                  \
  X(std::string, socketIfname, "socket_ifname", "")       /* MYCCL_SOCKET_IFNAME */              \
  X(std::string, masterAddr, "master_addr", "")           /* MASTER_ADDR: the default route */   \
  X(int64_t, restartCount, "restart_count", 0)            /* TORCHELASTIC_RESTART_COUNT */       \
  X(std::string, hostId, "host_id", "")                   /* MYCCL_HOST_ID */                    \
  X(int, hierarchical, "hierarchical", -1)                /* MYCCL_HIERARCHICAL: 1, 0, -1 auto */ \
  X(int64_t, linkMbit, "link_mbit", 0)                    /* MYCCL_LINK_MBIT */                  \
  X(bool, splitLinks, "split_links", true)                /* MYCCL_SPLIT_LINKS */                \
  X(bool, float32Partials, "float32_partials", false)     /* MYCCL_FLOAT32_PARTIALS */           \
  X(bool, crossHostRing, "cross_host_ring", true)         /* MYCCL_CROSS_HOST_RING */            \
  X(bool, orderedSums, "ordered_sums", true)              /* MYCCL_ORDERED_SUMS */               \
  X(int, numThreads, "num_threads", 1)                    /* MYCCL_NUM_THREADS */                \
  X(bool, debug, "debug", false)                          /* MYCCL_DEBUG=DETAIL */               \
  X(int64_t, tcpEagerBytes, "tcp_eager_bytes", 64 * 1024) /* MYCCL_TCP_EAGER_BYTES */            \
  X(int64_t, localEagerBytes, "local_eager_bytes", 1024 * 1024) /* MYCCL_LOCAL_EAGER_BYTES */    \
  X(int, copyThreads, "copy_threads", 2)                  /* MYCCL_COPY_THREADS */               \
  X(int, socketsPerPeer, "sockets_per_peer", 2)           /* MYCCL_SOCKETS_PER_PEER */           \
  X(int64_t, tcpChunkBytes, "tcp_chunk_bytes", 4 * 1024 * 1024) /* MYCCL_TCP_CHUNK_BYTES */      \
  X(int64_t, shmBufferBytes, "shm_buffer_bytes", 1 << 20) /* MYCCL_SHM_BUFFER_BYTES */           \
  X(int64_t, streamStoreBytes, "stream_store_bytes", -1)  /* MYCCL_STREAM_STORE_BYTES */         \
  X(int64_t, spinUs, "spin_us", -1)                       /* MYCCL_SPIN_US */                    \
  X(bool, blockingWait, "blocking_wait", false)           /* MYCCL_BLOCKING_WAIT */              \
  X(bool, avoidRecordStreams, "avoid_record_streams", true) /* MYCCL_AVOID_RECORD_STREAMS */     \
  X(bool, highPriorityStream, "high_priority_stream", false) /* MYCCL_HIGH_PRIORITY_STREAM */    \
  X(bool, ncclNonblocking, "nccl_nonblocking", false)     /* MYCCL_NCCL_NONBLOCKING */           \
  X(int, asyncErrorHandling, "async_error_handling", 3)   /* MYCCL_ASYNC_ERROR_HANDLING */       \
  X(bool, enableTiming, "enable_timing", false)           /* MYCCL_ENABLE_TIMING */              \
  X(int64_t, testConnectDelayMs, "test_connect_delay_ms", 0) /* MYCCL_TEST_CONNECT_DELAY_MS */   \
  X(int64_t, testShmRecheckDelayMs, "test_shm_recheck_delay_ms", 0) /* MYCCL_TEST_SHM_RECHECK_DELAY_MS */ \
  X(int64_t, flightRecorder, "flight_recorder", 128)      /* MYCCL_FLIGHT_RECORDER */            \
  X(std::string, flightRecorderDump, "flight_recorder_dump", "/tmp/myccl_flight_recorder") /* MYCCL_FLIGHT_RECORDER_DUMP */

namespace myccl {

struct Config {
#define MYCCL_CONFIG_MEMBER(type, member, pyName, dflt) type member = dflt;
  MYCCL_CONFIG_FIELDS(MYCCL_CONFIG_MEMBER)
#undef MYCCL_CONFIG_MEMBER
};

}  // namespace myccl
