/* The scheduling floor of this machine: a bare loop that sleeps, then
 * spins the last 150 us, to absolute deadlines every PERIOD_US, and
 * reports how late it woke (p50/p99/max in us) as one JSON line. Bounded:
 * COUNT deadlines.
 *
 *   cc -O2 -o floor floor.c && ./floor [COUNT] [PERIOD_US]
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 5000;
    long long period = (argc > 2 ? atoll(argv[2]) : 1000) * 1000LL;
    const long long spin = 150000;
    long long *late = malloc(sizeof(long long) * (size_t)count);
    if (!late || count < 1) return 1;
    long long deadline = now_ns() + period;
    for (int i = 0; i < count; i++, deadline += period) {
        long long wake = deadline - spin;
        struct timespec ts = { wake / 1000000000LL, wake % 1000000000LL };
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        long long t;
        while ((t = now_ns()) < deadline) { }
        late[i] = t - deadline;
    }
    qsort(late, (size_t)count, sizeof(long long), cmp);
    printf("{\"scenario\": \"floor\", \"count\": %d, \"period_us\": %lld, "
           "\"p50_us\": %.1f, \"p99_us\": %.1f, \"max_us\": %.1f}\n",
           count, period / 1000, late[count / 2] / 1e3,
           late[(int)((count - 1) * 0.99)] / 1e3, late[count - 1] / 1e3);
    free(late);
    return 0;
}
