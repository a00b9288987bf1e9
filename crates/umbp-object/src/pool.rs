//! The worker threads that talk to the store: a fixed number, so the store sees at most that many
//! requests of this medium at once, and no caller ever does store IO on its own thread (a caller
//! waits for its jobs with a deadline, and walks away when it passes).

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

/// One piece of store work.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads running [`Job`]s in submission order.
#[derive(Debug)]
pub(crate) struct Pool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `threads` workers named `name`.
    pub(crate) fn start(name: &str, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut pool = Self { tx: Some(tx), threads: Vec::with_capacity(threads) };
        for _ in 0..threads {
            let rx: Receiver<Job> = rx.clone();
            // On failure `pool` drops here: the workers already started see the channel close.
            let t = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            })?;
            pool.threads.push(t);
        }
        Ok(pool)
    }

    /// Queues `job`; false when the pool is stopping (the job is dropped unrun).
    pub(crate) fn submit(&self, job: Job) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// Closes the queue and waits for every worker: the jobs already queued run first (each
    /// bounded by its own deadline).
    pub(crate) fn stop(mut self) {
        self.close();
    }

    fn close(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!("an object-store worker thread panicked");
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn stop_runs_every_queued_job_then_joins() {
        let pool = Pool::start("t", 2).expect("threads");
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..50 {
            let done = Arc::clone(&done);
            assert!(pool.submit(Box::new(move || {
                done.fetch_add(1, Ordering::SeqCst);
            })));
        }
        pool.stop();
        assert_eq!(done.load(Ordering::SeqCst), 50);
    }
}
