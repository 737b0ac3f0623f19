// Ways of reading a list of file ranges from the disk, timed (issue 50: the disk tier's reads).
//
//     disk_read_methods FILE METHOD DEPTH < ranges      (one "offset length" pair a line)
//
// Reads every range once, prints one JSON line: method, depth, bytes (the ranges'), seconds, MB/s,
// and "cached": the share of the ranges' pages in the page cache before the clock started (the
// driver evicts the file first: 0 says the disk answered). Methods:
//   fault         mmap, MADV_RANDOM (llama.cpp's lazy tensors), touch a byte per page: one fault at a time
//   willneed      madvise(MADV_WILLNEED) on DEPTH ranges, then touch them; DEPTH 0: every range first
//   fadvise       posix_fadvise(POSIX_FADV_WILLNEED) on the fd instead, then touch via the mapping
//   pread         DEPTH threads, each preading whole ranges into its own buffer
//   odirect       ... on an O_DIRECT fd, ranges widened to 4 KiB
//   uring         io_uring, DEPTH reads of at most 1 MiB in flight; uring-direct: on an O_DIRECT fd
// Setup (open, mmap, buffers, the ring) is outside the clock: a tier does it once.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096ULL
#define CHUNK (1ULL << 20)

typedef struct { uint64_t off, len; } range;

static range *ranges;
static size_t n_ranges;
static uint64_t file_size;
static atomic_size_t next_range;  // the threads' shared counter
static atomic_int read_errno;     // the first failed read's errno
static volatile unsigned char sink;

static uint64_t down(uint64_t x) { return x & ~(PAGE - 1); }
static uint64_t up(uint64_t x) { return (x + PAGE - 1) & ~(PAGE - 1); }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

// a byte of every page: each load of a page not in memory waits for its read (or faults it in)
static void touch(const unsigned char *map, const range *r) {
    unsigned char s = 0;
    for (uint64_t p = r->off; p < r->off + r->len; p = down(p) + PAGE) {
        s ^= map[p];
    }
    sink ^= s;
}

// bytes this process has read from the block device (its threads' and its io_uring workers')
static uint64_t disk_bytes(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (uint64_t) u.ru_inblock * 512;
}

// the share of the ranges' pages in the page cache now (mincore does not read them)
static double cached(const unsigned char *map) {
    uint64_t in = 0, all = 0;
    for (size_t i = 0; i < n_ranges; ++i) {
        uint64_t b = down(ranges[i].off), n = (up(ranges[i].off + ranges[i].len) - b) / PAGE;
        unsigned char *vec = malloc(n);
        if (vec == NULL || mincore((void *) (map + b), n * PAGE, vec) != 0) die("mincore");
        for (uint64_t p = 0; p < n; ++p) in += vec[p] & 1;
        all += n;
        free(vec);
    }
    return all ? (double) in / all : 0.0;
}

// the mapped methods: advise `batch` ranges (0: all), then touch them, as the gate asks for one
// layer's experts before the layer's threads touch them
static void mapped(const char *method, int fd, const unsigned char *map, size_t batch) {
    if (batch == 0 || strcmp(method, "fault") == 0) batch = n_ranges;
    for (size_t b = 0; b < n_ranges; b += batch) {
        size_t e = b + batch < n_ranges ? b + batch : n_ranges;
        for (size_t i = b; i < e; ++i) {
            const range *r = &ranges[i];
            if (strcmp(method, "willneed") == 0) {
                madvise((void *) (map + down(r->off)), up(r->off + r->len) - down(r->off), MADV_WILLNEED);
            } else if (strcmp(method, "fadvise") == 0) {
                posix_fadvise(fd, (off_t) r->off, (off_t) r->len, POSIX_FADV_WILLNEED);
            }
        }
        for (size_t i = b; i < e; ++i) touch(map, &ranges[i]);
    }
}

// pread until len bytes or the end of the file: -errno on failure
static int read_all(int fd, unsigned char *buf, uint64_t off, uint64_t len) {
    while (len > 0 && off < file_size) {
        ssize_t got = pread(fd, buf, len, (off_t) off);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -errno;
        if (got == 0) break;
        buf += got, off += (uint64_t) got, len -= (uint64_t) got;
    }
    return 0;
}

typedef struct { int fd, direct; unsigned char *buf; } reader_arg;

static void *reader(void *p) {
    const reader_arg *a = p;
    for (size_t i; (i = atomic_fetch_add(&next_range, 1)) < n_ranges;) {
        uint64_t off = ranges[i].off, len = ranges[i].len;
        if (a->direct) len = up(off + len) - down(off), off = down(off);  // O_DIRECT: aligned offsets and sizes
        int err = read_all(a->fd, a->buf, off, len);
        int none = 0;
        if (err) atomic_compare_exchange_strong(&read_errno, &none, -err);
    }
    return NULL;
}

static void threads(int fd, int direct, int depth, uint64_t buf_bytes, double *t0) {
    pthread_t th[depth];
    reader_arg args[depth];
    for (int i = 0; i < depth; ++i) {  // the tier's own buffers: allocated and faulted in beforehand
        args[i] = (reader_arg) { fd, direct, NULL };
        if (posix_memalign((void **) &args[i].buf, PAGE, buf_bytes) != 0) die("posix_memalign");
        memset(args[i].buf, 0, buf_bytes);
    }
    *t0 = now();
    for (int i = 0; i < depth; ++i) pthread_create(&th[i], NULL, reader, &args[i]);
    for (int i = 0; i < depth; ++i) pthread_join(th[i], NULL);
    for (int i = 0; i < depth; ++i) free(args[i].buf);
}

// io_uring by its raw system calls: the submission and completion rings are shared memory
typedef struct { uint64_t off, len; int busy; unsigned char *buf; } slot;

static int uring(int fd, int direct, unsigned depth, double *t0) {
    struct io_uring_params p = { 0 };
    int ring = (int) syscall(__NR_io_uring_setup, depth, &p);
    if (ring < 0) return -errno;
    size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) sq_bytes = cq_bytes = sq_bytes > cq_bytes ? sq_bytes : cq_bytes;
    unsigned char *sq = mmap(NULL, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQ_RING);
    unsigned char *cq = (p.features & IORING_FEAT_SINGLE_MMAP) ? sq
        : mmap(NULL, cq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_CQ_RING);
    struct io_uring_sqe *sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                                     MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || sqes == MAP_FAILED) die("mmap io_uring");
    unsigned *sq_tail = (unsigned *) (sq + p.sq_off.tail), *sq_array = (unsigned *) (sq + p.sq_off.array);
    unsigned *cq_head = (unsigned *) (cq + p.cq_off.head), *cq_tail = (unsigned *) (cq + p.cq_off.tail);
    unsigned sq_mask = *(unsigned *) (sq + p.sq_off.ring_mask), cq_mask = *(unsigned *) (cq + p.cq_off.ring_mask);
    struct io_uring_cqe *cqes = (struct io_uring_cqe *) (cq + p.cq_off.cqes);

    slot s[depth];
    for (unsigned i = 0; i < depth; ++i) {
        s[i] = (slot) { 0, 0, 0, NULL };
        if (posix_memalign((void **) &s[i].buf, PAGE, CHUNK) != 0) die("posix_memalign");
        memset(s[i].buf, 0, CHUNK);
    }
    size_t ri = 0;     // the next range to cut chunks from
    uint64_t at = 0;   // ... and the offset reached in it
    unsigned busy = 0;
    int err = 0;
    *t0 = now();
    for (;;) {
        unsigned tail = *sq_tail, queued = 0;  // only this thread writes the tail
        for (unsigned i = 0; i < depth && !err; ++i) {
            if (s[i].busy) continue;
            if (s[i].len == 0 && ri < n_ranges) {  // a free slot takes the next chunk
                uint64_t b = direct ? down(ranges[ri].off) : ranges[ri].off;
                uint64_t e = direct ? up(ranges[ri].off + ranges[ri].len) : ranges[ri].off + ranges[ri].len;
                if (at < b) at = b;
                s[i].off = at, s[i].len = e - at < CHUNK ? e - at : CHUNK;
                at += s[i].len;
                if (at >= e) ri++, at = 0;
            }
            if (s[i].len == 0) continue;
            struct io_uring_sqe *q = &sqes[tail & sq_mask];
            memset(q, 0, sizeof *q);
            q->opcode = IORING_OP_READ, q->fd = fd, q->off = s[i].off;
            q->addr = (uint64_t) (uintptr_t) s[i].buf, q->len = (unsigned) s[i].len, q->user_data = i;
            sq_array[tail & sq_mask] = tail & sq_mask;
            tail++, queued++, busy++, s[i].busy = 1;
        }
        __atomic_store_n(sq_tail, tail, __ATOMIC_RELEASE);  // the kernel sees the entries before the tail
        if (busy == 0) break;
        if (syscall(__NR_io_uring_enter, ring, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 && errno != EINTR) {
            err = -errno;
            break;
        }
        unsigned head = *cq_head;
        for (; head != __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE); head++) {
            const struct io_uring_cqe *c = &cqes[head & cq_mask];
            slot *d = &s[c->user_data];
            d->busy = 0, busy--;
            if (c->res < 0) {
                if (!err) err = c->res;
                d->len = 0;
            } else if (c->res == 0 || d->off + (uint64_t) c->res >= file_size) {
                d->len = 0;  // the end of the file
            } else {
                d->off += (uint64_t) c->res, d->len -= (uint64_t) c->res;  // a short read: the rest next round
            }
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
    }
    close(ring);
    for (unsigned i = 0; i < depth; ++i) free(s[i].buf);
    return err;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s FILE fault|willneed|fadvise|pread|odirect|uring|uring-direct DEPTH < ranges\n", argv[0]);
        return 2;
    }
    const char *path = argv[1], *method = argv[2];
    int depth = atoi(argv[3]);
    size_t cap = 0;
    for (uint64_t off, len; scanf("%" SCNu64 " %" SCNu64, &off, &len) == 2;) {
        if (n_ranges == cap && !(ranges = realloc(ranges, (cap = cap ? 2 * cap : 256) * sizeof *ranges))) die("realloc");
        ranges[n_ranges++] = (range) { off, len };
    }
    uint64_t bytes = 0, widest = 0;
    for (size_t i = 0; i < n_ranges; ++i) {
        bytes += ranges[i].len;
        uint64_t w = up(ranges[i].off + ranges[i].len) - down(ranges[i].off);
        widest = w > widest ? w : widest;
    }
    int direct = strcmp(method, "odirect") == 0 || strcmp(method, "uring-direct") == 0;
    int fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (errno != EINVAL) die(path);
        printf("{\"method\": \"%s\", \"depth\": %d, \"error\": \"open: %s\"}\n", method, depth, strerror(errno));
        return 0;
    }
    file_size = (uint64_t) st.st_size;
    unsigned char *map = mmap(NULL, file_size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) die("mmap");
    madvise(map, file_size, MADV_RANDOM);  // as llama.cpp maps lazy tensors: a fault reads its page only
    double in_cache = cached(map), t0 = 0, t1;
    uint64_t disk0 = disk_bytes();
    int err = 0;
    if (strcmp(method, "fault") == 0 || strcmp(method, "willneed") == 0 || strcmp(method, "fadvise") == 0) {
        t0 = now();
        mapped(method, fd, map, (size_t) depth);
    } else if (strcmp(method, "pread") == 0 || strcmp(method, "odirect") == 0) {
        threads(fd, direct, depth > 0 ? depth : 1, widest, &t0);
        err = -atomic_load(&read_errno);
    } else if (strcmp(method, "uring") == 0 || strcmp(method, "uring-direct") == 0) {
        err = uring(fd, direct, depth > 0 ? (unsigned) depth : 1, &t0);
    } else {
        fprintf(stderr, "unknown method %s\n", method);
        return 2;
    }
    t1 = now();
    if (err) {
        printf("{\"method\": \"%s\", \"depth\": %d, \"error\": \"%s\"}\n", method, depth, strerror(-err));
        return err == -EINVAL ? 0 : 1;
    }
    printf("{\"method\": \"%s\", \"depth\": %d, \"bytes\": %" PRIu64 ", \"seconds\": %.6f, \"MB/s\": %.1f, "
           "\"disk_bytes\": %" PRIu64 ", \"cached\": %.4f}\n",
           method, depth, bytes, t1 - t0, bytes / (t1 - t0) / 1e6, disk_bytes() - disk0, in_cache);
    return 0;
}
