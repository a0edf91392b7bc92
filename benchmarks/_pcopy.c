// Diagnostic: a parallel host memcpy with its own threads and dynamic pieces (optionally non-temporal).
// cc -O3 -mavx2 -shared -fPIC -pthread -o _pcopy.so _pcopy.c
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define MAXT 64

static pthread_t threads[MAXT];
static int nthreads = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go = PTHREAD_COND_INITIALIZER;
static pthread_cond_t fin = PTHREAD_COND_INITIALIZER;
static unsigned long gen = 0;
static int active = 0;

static char *j_dst;
static const char *j_src;
static size_t j_n, j_piece;
static int j_nt, j_limit;
static atomic_size_t j_next;

static void copy_nt(char *d, const char *s, size_t n) {
    // d is 32-byte aligned by the caller's pieces when the base is; else plain memcpy
    if (((uintptr_t)d & 31) != 0) { memcpy(d, s, n); return; }
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    if (i < n) memcpy(d + i, s + i, n - i);
    _mm_sfence();
}

static void work(void) {
    for (;;) {
        size_t off = atomic_fetch_add(&j_next, j_piece);
        if (off >= j_n) break;
        size_t m = j_n - off < j_piece ? j_n - off : j_piece;
        if (j_nt) copy_nt(j_dst + off, j_src + off, m);
        else memcpy(j_dst + off, j_src + off, m);
    }
}

static void *loop(void *arg) {
    long idx = (long)arg;
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&mu);
        while (gen == seen) pthread_cond_wait(&go, &mu);
        seen = gen;
        pthread_mutex_unlock(&mu);
        if (idx < j_limit - 1) work();
        pthread_mutex_lock(&mu);
        if (--active == 0) pthread_cond_signal(&fin);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

int pcopy_init(int n) {
    if (n > MAXT) n = MAXT;
    while (nthreads < n - 1) {  // the caller is one of the n
        if (pthread_create(&threads[nthreads], NULL, loop, (void *)(long)nthreads) != 0) return -1;
        pthread_detach(threads[nthreads]);
        nthreads++;
    }
    return nthreads + 1;
}

void pcopy(void *dst, const void *src, size_t n, size_t piece, int nt, int limit) {
    pthread_mutex_lock(&mu);
    j_dst = dst; j_src = src; j_n = n; j_piece = piece; j_nt = nt; j_limit = limit;
    atomic_store(&j_next, 0);
    active = nthreads;
    gen++;
    pthread_cond_broadcast(&go);
    pthread_mutex_unlock(&mu);
    work();
    pthread_mutex_lock(&mu);
    while (active > 0) pthread_cond_wait(&fin, &mu);
    pthread_mutex_unlock(&mu);
}
