//! The log's way out: log lines are handed to a writer thread through a bounded queue, so a log
//! reader that stops reading (a full pipe, a stalled collector) never blocks a request.
//!
//! Key decision: when the queue is full, the line is dropped, counted in
//! `cortex_log_lines_dropped_total`, and the writer says how many were dropped as soon as it can
//! write again. Serving goes on at the price of log lines; blocking on the log would stall every
//! runtime thread that logs (an access log line per request) behind the slowest reader.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Counter: log lines dropped because the log's reader did not keep up (`stream` = `stderr` or
/// `stdout`).
pub const LOG_LINES_DROPPED: &str = "cortex_log_lines_dropped_total";

/// The queue's default size: 4 MiB of lines waiting for the reader.
pub const DEFAULT_BUFFER_BYTES: usize = 4 << 20;

/// Describes the log pipe's metric to the installed recorder and registers both streams, at the
/// lines `pipes` dropped before there was a recorder to count them (0 for a stream without one).
pub fn describe(pipes: &[LogPipe]) {
    metrics::describe_counter!(
        LOG_LINES_DROPPED,
        "Log lines dropped because the log's reader did not keep up."
    );
    for stream in [Stream::Stderr, Stream::Stdout] {
        let dropped = pipes.iter().filter(|p| p.shared.stream == stream).map(LogPipe::dropped).sum();
        metrics::counter!(LOG_LINES_DROPPED, "stream" => stream.as_str()).absolute(dropped);
    }
}

/// Which standard stream a pipe writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// The process's stderr (the logs).
    Stderr,
    /// The process's stdout (the JSON access log).
    Stdout,
}

impl Stream {
    const fn as_str(self) -> &'static str {
        match self {
            Stream::Stderr => "stderr",
            Stream::Stdout => "stdout",
        }
    }
}

struct Queue {
    lines: VecDeque<Vec<u8>>,
    bytes: usize,
    /// Lines taken by the writer and not yet written.
    writing: usize,
    closed: bool,
}

/// How long the writer sleeps when it finds nothing to write: a line waits at most this long
/// unless the queue is half full, so that logging a line never wakes another thread.
const WRITE_EVERY: Duration = Duration::from_millis(25);

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when the queue is half full, on a flush or close (the writer waits on it), and
    /// when the writer has written what it took (flushes wait on it).
    changed: Condvar,
    capacity: usize,
    dropped: AtomicU64,
    stream: Stream,
}

/// A [`tracing_subscriber::fmt::MakeWriter`] whose lines go to a writer thread. Cloning shares the
/// queue.
#[derive(Clone)]
pub struct LogPipe {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LogPipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogPipe").field("stream", &self.shared.stream).finish_non_exhaustive()
    }
}

impl LogPipe {
    /// A pipe to `stream` holding at most `capacity` bytes of lines (at least one line).
    ///
    /// # Errors
    /// The writer thread cannot be started.
    pub fn start(stream: Stream, capacity: usize) -> std::io::Result<LogPipe> {
        let out: Box<dyn Write + Send> = match stream {
            Stream::Stderr => Box::new(std::io::stderr()),
            Stream::Stdout => Box::new(std::io::stdout()),
        };
        LogPipe::to(out, stream, capacity)
    }

    /// A pipe to `out` (`stream` names it in the metric).
    ///
    /// # Errors
    /// The writer thread cannot be started.
    pub fn to(out: Box<dyn Write + Send>, stream: Stream, capacity: usize) -> std::io::Result<LogPipe> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { lines: VecDeque::new(), bytes: 0, writing: 0, closed: false }),
            changed: Condvar::new(),
            capacity,
            dropped: AtomicU64::new(0),
            stream,
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("cortex-log-{}", stream.as_str()))
            .spawn(move || write_loop(&s, out))?;
        Ok(LogPipe { shared })
    }

    /// Lines dropped so far.
    #[must_use]
    pub fn dropped(&self) -> u64 {
        // Relaxed: a counter read as a status.
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Waits until every line queued so far is written, or `timeout` passes (a reader that does
    /// not read must not hold the process at exit). Returns whether everything was written.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
        // Wakes the writer now rather than at its next round.
        self.shared.changed.notify_all();
        while !q.lines.is_empty() || q.writing > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self.shared.changed.wait_timeout(q, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        true
    }

    /// Stops the writer once the queue is written (lines sent later are dropped).
    pub fn close(&self) {
        self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        self.shared.changed.notify_all();
    }

    fn send(&self, line: Vec<u8>) {
        if line.is_empty() {
            return;
        }
        let mut q = self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let fits = q.lines.is_empty() || q.bytes + line.len() <= self.shared.capacity;
        if fits && !q.closed {
            q.bytes += line.len();
            q.lines.push_back(line);
            let urgent = q.bytes > self.shared.capacity / 2;
            drop(q);
            if urgent {
                self.shared.changed.notify_all();
            }
        } else {
            drop(q);
            // Relaxed: a counter; the writer reports it when it can write again.
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(LOG_LINES_DROPPED, "stream" => self.shared.stream.as_str()).increment(1);
        }
    }
}

fn write_loop(shared: &Shared, mut out: Box<dyn Write + Send>) {
    let mut reported = 0;
    let mut batch = Vec::new();
    loop {
        {
            let mut q = shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.writing = 0;
            shared.changed.notify_all();
            while q.lines.is_empty() {
                if q.closed {
                    return;
                }
                q = shared.changed.wait_timeout(q, WRITE_EVERY).unwrap_or_else(PoisonError::into_inner).0;
            }
            q.writing = q.lines.len();
            q.bytes = 0;
            batch.extend(q.lines.drain(..));
        }
        // Relaxed: a counter.
        let dropped = shared.dropped.load(Ordering::Relaxed);
        if dropped > reported {
            let _ = writeln!(
                out,
                "cortex-gateway: {} log line(s) dropped: the log's reader did not keep up (cortex_log_lines_dropped_total)",
                dropped - reported
            );
            reported = dropped;
        }
        // Errors (a reader that closed the pipe) lose the lines; there is nowhere to say so.
        for line in batch.drain(..) {
            let _ = out.write_all(&line);
        }
        let _ = out.flush();
    }
}

/// One log line being formatted; queued when dropped.
#[derive(Debug)]
pub struct Line<'a> {
    pipe: &'a LogPipe,
    buf: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        self.pipe.send(std::mem::take(&mut self.buf));
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogPipe {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line { pipe: self, buf: Vec::with_capacity(256) }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A writer that blocks until the test opens its gate, then collects.
    #[derive(Clone)]
    struct Gated {
        open: Arc<(Mutex<bool>, Condvar)>,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Gated {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let (m, c) = &*self.open;
            let mut open = m.lock().unwrap();
            while !*open {
                open = c.wait(open).unwrap();
            }
            self.got.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(pipe: &LogPipe, text: &str) {
        use tracing_subscriber::fmt::MakeWriter;
        let mut w = pipe.make_writer();
        w.write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn a_stalled_reader_costs_lines_not_time_and_hears_of_them_later() {
        let gated = Gated { open: Arc::new((Mutex::new(false), Condvar::new())), got: Arc::default() };
        let pipe = LogPipe::to(Box::new(gated.clone()), Stream::Stderr, 100).unwrap();
        let start = Instant::now();
        for i in 0..1000 {
            line(&pipe, &format!("line {i:04}\n"));
        }
        // Nothing waited for the reader: 1,000 lines against a writer stuck on its first.
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(!pipe.flush(Duration::from_millis(50)), "the stuck writer cannot have written");
        // Kept: what the writer took before it blocked (one line, or at most a full queue) and
        // a full queue of 100 bytes (ten lines).
        let dropped = pipe.dropped();
        assert!(dropped >= 1000 - 20, "dropped {dropped}");
        {
            let (m, c) = &*gated.open;
            *m.lock().unwrap() = true;
            c.notify_all();
        }
        assert!(pipe.flush(Duration::from_secs(5)));
        line(&pipe, "after\n");
        assert!(pipe.flush(Duration::from_secs(5)));
        let got = String::from_utf8(gated.got.lock().unwrap().clone()).unwrap();
        assert_eq!(got.lines().find(|l| l.starts_with("line ")), Some("line 0000"), "{got}");
        // Every drop is reported, before the next line written after it.
        let reported: u64 = got
            .lines()
            .filter_map(|l| l.strip_prefix("cortex-gateway: ")?.split(' ').next()?.parse::<u64>().ok())
            .sum();
        assert_eq!(reported, dropped, "{got}");
        assert!(got.ends_with("after\n"), "{got}");
        // Kept lines arrive whole and in order.
        let kept: Vec<&str> = got.lines().filter(|l| l.starts_with("line ")).collect();
        assert_eq!(kept.len() as u64, 1000 - dropped);
        assert!(kept.windows(2).all(|w| w[0] < w[1]), "{kept:?}");
        pipe.close();
    }

    #[test]
    fn a_line_longer_than_the_buffer_still_passes_when_nothing_waits() {
        let got = Arc::new(Mutex::new(Vec::new()));
        struct Collect(Arc<Mutex<Vec<u8>>>);
        impl Write for Collect {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let pipe = LogPipe::to(Box::new(Collect(Arc::clone(&got))), Stream::Stdout, 8).unwrap();
        let long = format!("{}\n", "x".repeat(100));
        line(&pipe, &long);
        assert!(pipe.flush(Duration::from_secs(5)));
        assert_eq!(pipe.dropped(), 0);
        assert_eq!(*got.lock().unwrap(), long.as_bytes());
        pipe.close();
    }
}
