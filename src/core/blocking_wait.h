#pragma once
// A process-wide record of the blocking wait the main thread is in: a communication call, or a wait for
// the GPU (stream synchronisation, a device->host copy). The collective watchdog (dist/watchdog.h) reads
// it from its own thread; recording costs two atomic stores, so it is always on. Waits do not nest: the
// outermost one is recorded (an NCCL call's host synchronisation inside a collective counts as the
// collective).
#include <cstdint>

namespace ndt {

class BlockingWait {
 public:
  // `what`: a string literal naming the call ("all_reduce", "device synchronize"); group: the ranks it
  // waits on (1 for the local GPU).
  BlockingWait(const char* what, int group);
  ~BlockingWait();
  BlockingWait(const BlockingWait&) = delete;
  BlockingWait& operator=(const BlockingWait&) = delete;

  struct Snapshot {
    const char* what = nullptr;  // null: no wait in flight
    int group = 0;
    double seconds = 0;  // how long it has been waiting
  };
  static Snapshot current();

 private:
  bool outer_ = false;
};

}  // namespace ndt
