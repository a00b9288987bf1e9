//! The HBM medium passes the medium conformance suite: over the fake GPU runtime everywhere, and over
//! the machine's real runtime when it has a GPU (skipped with a printed reason otherwise).

use std::sync::Arc;
use std::time::Duration;

use umbp_core::TierType;
use umbp_gpu::{FakeRuntime, GpuRuntime};
use umbp_hbm::HbmPageMemorySource;
use umbp_page::{PageBackend, PageBackendConfig};
use umbp_testkit::conformance::{self, Env, Subject};

fn subject(env: &Env, runtime: Arc<dyn GpuRuntime>, device: u32, config: PageBackendConfig) -> Subject {
    let config = config.with_clock(env.clock());
    let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
    let source = HbmPageMemorySource::new(runtime, device).expect("device exists");
    let backend = Arc::new(PageBackend::new(config, Box::new(source)).expect("valid config"));
    let reaper = Arc::clone(&backend);
    Subject { backend, tick: Box::new(move || reaper.reaper_tick()), read_lease, pending_ttl, background_reaper: true }
}

#[test]
fn hbm_backend_conforms_on_the_fake_runtime() {
    // The reference geometry (3 buffers x 4 pages x 1 KiB) on device 1 of a two-device fake.
    let fake: Arc<dyn GpuRuntime> = Arc::new(FakeRuntime::new(2));
    conformance::run(|env| {
        subject(env, Arc::clone(&fake), 1, PageBackendConfig::new(TierType::Hbm, 1024, vec![4096; 3]))
    });
}

#[test]
fn hbm_backend_conforms_on_the_fake_runtime_with_a_busy_reaper() {
    let fake: Arc<dyn GpuRuntime> = Arc::new(FakeRuntime::new(1));
    conformance::run(|env| {
        subject(
            env,
            Arc::clone(&fake),
            0,
            PageBackendConfig::new(TierType::Hbm, 4096, vec![256 * 4096])
                .with_reaper_interval(Duration::from_millis(1))
                .with_pending_ttl(Duration::from_millis(20))
                .with_read_lease_ttl(Duration::from_millis(40)),
        )
    });
}

#[test]
fn hbm_backend_conforms_on_a_real_gpu() {
    let Some(gpu) = umbp_gpu::probe() else {
        assert!(!umbp_gpu::gpu_required(), "UMBP_REQUIRE_GPU=1 but no HIP or CUDA runtime with a device was found");
        eprintln!("skipped: no HIP or CUDA runtime with a device found (set by umbp_gpu::probe)");
        return;
    };
    eprintln!("running on the {} runtime ({} devices)", gpu.name(), gpu.device_count().unwrap_or(0));
    conformance::run(|env| {
        subject(env, Arc::clone(&gpu), 0, PageBackendConfig::new(TierType::Hbm, 64 << 10, vec![16 << 20]))
    });
}
