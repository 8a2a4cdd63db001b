//! The node commands' async runtime: current-thread tokio (I/O and timers), built in one place.
//!
//! A command that runs async code for its whole life (`migrate`, `recover`, `probe`) builds one
//! with [`current_thread`] and blocks on it; an agent that makes API calls from a synchronous
//! loop (`kubeadm-sync`) uses [`block_on`], which runs each call on this thread's runtime,
//! built at the first call and kept (not one per call).

use std::cell::OnceCell;
use std::future::Future;

/// A current-thread runtime with I/O and timers.
pub fn current_thread() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

thread_local! {
    static RUNTIME: OnceCell<tokio::runtime::Runtime> = const { OnceCell::new() };
}

/// Runs `f` to its end on this thread's runtime (built at the first call). Not from async
/// code: a runtime cannot block inside another (tokio panics).
///
/// # Panics
///
/// When the runtime cannot be built (the process is out of descriptors or threads).
pub fn block_on<F: Future>(f: F) -> F::Output {
    RUNTIME.with(|cell| {
        cell.get_or_init(|| current_thread().expect("tokio runtime"))
            .block_on(f)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_runtime_per_thread_kept_between_calls() {
        let a = block_on(async { tokio::runtime::Handle::current().id() });
        let b = block_on(async {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            tokio::runtime::Handle::current().id()
        });
        assert_eq!(a, b);
        let other =
            std::thread::spawn(|| block_on(async { tokio::runtime::Handle::current().id() }))
                .join()
                .unwrap();
        assert_ne!(a, other);
    }
}
