/* C11 cnd_timedwait through pthread_cond_timedwait, preloaded before
 * libfaketime into region-node and the aggregator in benchmark scenario 6b
 * (see bench/src/scenario/rollover.rs): libfaketime translates the
 * CLOCK_REALTIME deadline of pthread_cond_timedwait, not of C11's
 * cnd_timedwait, which librdkafka uses. */
#include <errno.h>
#include <pthread.h>
#include <threads.h>
int cnd_timedwait(cnd_t *restrict cond, mtx_t *restrict mutex, const struct timespec *restrict ts)
{
    int r = pthread_cond_timedwait((pthread_cond_t *)cond, (pthread_mutex_t *)mutex, ts);
    return r == 0 ? thrd_success : r == ETIMEDOUT ? thrd_timedout : thrd_error;
}
