/* The host side of an NCCL rank, for tests/jobs/nccl_like.py (built with cc at the job's start, loaded with ctypes).
 *
 * On a GPU a collective is enqueued on a CUDA stream and the host goes on; it waits only at the next device sync
 * (loss.item(), cudaStreamSynchronize), and CUDA's default wait *spins*: the main thread runs at ~1 core and never
 * sleeps (0 voluntary context switches). NCCL's proxy progress thread polls its transports while an operation is
 * active (std::this_thread::yield() between polls, no sleep) and blocks on a condition variable when none is
 * (proxy.cc: ncclProxyProgress / ncclProxyGetPostedOps). Measured on an H200 (shared/real-gpu): a rank waiting in
 * NCCL is 2.0 cores, 0 wakeups/s.
 *
 *   stream_enqueue()               a collective was launched (the job calls it when it issues the gloo op)
 *   stream_complete()              one finished (called from the gloo future's done-callback)
 *   cudaStreamSynchronize(stream)  spin until nothing is pending: no syscall, no sleep (ctypes drops the GIL)
 *   ncclProxyProgress(arg)         the proxy thread's body: spins with sched_yield() while something is pending
 *   stream_shutdown()              ends ncclProxyProgress()
 *
 * The two spinning functions carry the names of what they stand for, so a native stack (py-spy --native) of a
 * waiting rank reads as on the GPU: cudaStreamSynchronize under the loss.item() line, ncclProxyProgress in the
 * proxy thread. Everything is C so that neither spinning thread needs Python's GIL: a Python busy loop in two
 * threads would hand the GIL back and forth, and every hand-over is a voluntary context switch of the main thread.
 */
#include <pthread.h>
#include <stddef.h>
#include <sched.h>
#include <stdatomic.h>

static atomic_long pending;
static atomic_long launched;
static atomic_long completed;
static atomic_int stopping;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t posted = PTHREAD_COND_INITIALIZER;

long stream_pending(void) { return atomic_load(&pending); }
long stream_launched(void) { return atomic_load(&launched); }
long stream_completed(void) { return atomic_load(&completed); }

void stream_enqueue(void) {
    atomic_fetch_add(&launched, 1);
    pthread_mutex_lock(&mu);
    atomic_fetch_add(&pending, 1);
    pthread_cond_signal(&posted);
    pthread_mutex_unlock(&mu);
}

void stream_complete(void) {
    atomic_fetch_add(&completed, 1);
    atomic_fetch_sub(&pending, 1);
}

int cudaStreamSynchronize(void *stream);
void *ncclProxyProgress(void *arg);

int cudaStreamSynchronize(void *stream) {
    (void)stream;
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    return 0;
}

void *ncclProxyProgress(void *arg) {
    (void)arg;
    volatile unsigned long polls = 0;
    while (!atomic_load(&stopping)) {
        pthread_mutex_lock(&mu);
        while (atomic_load(&pending) == 0 && !atomic_load(&stopping))
            pthread_cond_wait(&posted, &mu);
        pthread_mutex_unlock(&mu);
        while (atomic_load(&pending) > 0 && !atomic_load(&stopping)) {
            for (int i = 0; i < 4096; i++) polls++; /* "progressOps": look at the transport's FIFOs */
            sched_yield();                          /* nothing progressed: let others run (not a sleep) */
        }
    }
    return NULL;
}

void stream_shutdown(void) {
    pthread_mutex_lock(&mu);
    atomic_store(&stopping, 1);
    pthread_cond_broadcast(&posted);
    pthread_mutex_unlock(&mu);
}
